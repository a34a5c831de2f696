"""Chat encoding: assistant-only labels, input validation, data loading, Arrow caching, built-in data."""

from __future__ import annotations

import contextlib
import json
import re

import datasets
import numpy as np
import pytest

import varpack.data.chat as chat_mod
from varpack.data.builtin import builtin_chats, topic_paragraphs
from varpack.data.chat import encode_chat, encode_dataset, load_chat_data, validate_messages
from varpack.data.tokenizer import load_tokenizer

IGNORE = -100

SINGLE = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "2+2 is 4."}]
MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Sure: 11.\n\n```python\nprint(11)\n```"},
    {"role": "user", "content": "Thanks"},
    {"role": "assistant", "content": "\n\nYou're welcome!  "},  # leading newlines, trailing spaces
]
TOOLS = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'},
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "21 °C and clear."},
    {"role": "user", "content": "ok"},
]
CHATS = [SINGLE, MULTI, TOOLS]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("qwen3")


@contextlib.contextmanager
def template(tok, chat_template):
    """Temporarily give the (shared) tokenizer another chat template (a deepcopy takes seconds)."""
    saved = tok.chat_template
    tok.chat_template = chat_template
    try:
        yield tok
    finally:
        tok.chat_template = saved


def without_generation_markers(chat_template):
    plain = chat_template.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    assert "{%- generation" not in plain and "endgeneration" not in plain and plain != chat_template
    return plain


def expected_labels(tok, input_ids):
    """Independent oracle on token ids: after each ``<|im_start|>assistant`` + ``\n`` header, everything
    up to and including the next ``<|im_end|>`` is supervised; all else -100; first label -100. When the
    content starts with newlines, the header's ``\n`` merges with them into one token, which then belongs
    to the reply (it overlaps the content; transformers' assistant mask does the same)."""
    im_start, im_end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    (assistant,) = tok("assistant", add_special_tokens=False)["input_ids"]
    labels = [IGNORE] * len(input_ids)
    t = 0
    while t < len(input_ids):
        if input_ids[t : t + 2] == [im_start, assistant]:
            t += 2
            newline = tok.decode([input_ids[t]])
            assert newline.startswith("\n") and not newline.strip()
            if newline == "\n":
                t += 1
            while input_ids[t] != im_end:
                labels[t] = input_ids[t]
                t += 1
            labels[t] = im_end
        t += 1
    labels[0] = IGNORE
    return labels


@pytest.mark.parametrize("messages", CHATS, ids=["single", "multi", "tools"])
def test_labels_supervise_exactly_the_assistant_turns(tok, messages):
    out = encode_chat(messages, tok, sample_id=0)
    ids, labels = out["input_ids"], out["labels"]
    assert ids == tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert out["length"] == len(ids) == len(labels)
    assert labels == expected_labels(tok, ids)
    assert labels[0] == IGNORE
    assert all(lab in (IGNORE, t) for lab, t in zip(labels, ids))
    # the supervised tokens decode to each assistant content followed by <|im_end|>, nothing else
    runs, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    assistant = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(runs) == len(assistant)
    for run, content in zip(runs, assistant):
        decoded = tok.decode(run)
        # a token may straddle the header's "\n" and the content's leading newlines
        assert decoded.endswith(content + "<|im_end|>") and decoded.strip("\n") == (content + "<|im_end|>").strip("\n")


def test_first_label_is_ignored_even_when_the_first_token_is_supervised(tok):
    assistant_first = (
        "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- generation %}{{ m.content }}"
        "{%- endgeneration %}{%- else %}{{ m.content }}{%- endif %}{%- endfor %}"
    )
    with template(tok, assistant_first) as t:
        out = encode_chat([{"role": "assistant", "content": "Hi there"}, {"role": "user", "content": " ok"}], t)
    ids = out["input_ids"]
    assert ids == tok("Hi there ok", add_special_tokens=False)["input_ids"]
    n = len(tok("Hi there", add_special_tokens=False)["input_ids"])
    assert out["labels"] == [IGNORE] + ids[1:n] + [IGNORE] * (len(ids) - n)


@pytest.mark.parametrize("messages", CHATS, ids=["single", "multi", "tools"])
def test_prefix_method_matches_generation_markers(tok, messages):
    assert chat_mod._uses_generation_markers(tok)
    marked = encode_chat(messages, tok, sample_id=1)
    with template(tok, without_generation_markers(tok.chat_template)) as plain:
        assert not chat_mod._uses_generation_markers(plain)
        assert encode_chat(messages, plain, sample_id=1) == marked


class _NotFast:
    """A tokenizer seen as slow (no offsets): exercises the token-prefix branch."""

    is_fast = False

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("messages", CHATS, ids=["single", "multi", "tools"])
def test_prefix_method_without_offsets_matches(tok, messages):
    slow = _NotFast(tok)  # has generation markers, but they need offsets, so the prefix method runs
    assert not chat_mod._uses_generation_markers(slow)
    assert encode_chat(messages, slow) == encode_chat(messages, tok)


def test_template_that_is_not_prefix_stable_is_refused(tok):
    marks_last = (
        "{%- for m in messages %}{%- if loop.last %}[last]{%- endif %}{{ m.role }}: {{ m.content }}\n"
        "{%- endfor %}{%- if add_generation_prompt %}assistant: {%- endif %}"
    )
    with template(tok, marks_last) as t, pytest.raises(ValueError, match=r"sample 42: .*not prefix-stable at messages\[1\]"):
        encode_chat(SINGLE, t, sample_id=42)


def test_no_chat_template(tok):
    with template(tok, None) as t, pytest.raises(ValueError, match="no chat template"):
        encode_chat(SINGLE, t)


@pytest.mark.parametrize(
    ("messages", "error", "pattern"),
    [
        ("hello", TypeError, r"sample 7: messages must be a list"),
        (None, TypeError, r"sample 7: messages must be a list"),
        ([], ValueError, r"sample 7: messages is empty"),
        (["hi"], TypeError, r"sample 7: messages\[0\] must be a dict"),
        ([{"content": "x"}, SINGLE[1]], TypeError, r"sample 7: messages\[0\]\.role is missing"),
        ([SINGLE[0], {"role": "assistant"}], TypeError, r"sample 7: messages\[1\]\.content is missing"),
        ([SINGLE[0], {"role": "assistant", "content": None}], TypeError, r"messages\[1\]\.content is missing"),
        (
            [*MULTI[:3], {"role": "user", "content": 5}],
            TypeError,
            r"sample 7: messages\[3\]\.content must be a str, got int \(5\)",
        ),
        (
            [SINGLE[0], {"role": "assistant", "content": ["a"]}],
            TypeError,
            r"messages\[1\]\.content must be a str, got list",
        ),
        ([{"role": "bot", "content": "x"}], ValueError, r"sample 7: messages\[0\]\.role='bot' is not one of"),
        ([{"role": "user", "content": "x"}], ValueError, r"sample 7: no assistant message"),
        (
            [SINGLE[0], {"role": "assistant", "content": ""}],
            ValueError,
            r"sample 7: messages\[1\]\.content is empty \(an assistant answer with no text to supervise\)",
        ),
        (
            [*MULTI[:3], {"role": "assistant", "content": " \n"}],
            ValueError,
            r"sample 7: messages\[3\]\.content is empty",
        ),
    ],
)
def test_bad_input_names_sample_and_field(tok, messages, error, pattern):
    with pytest.raises(error, match=pattern):
        encode_chat(messages, tok, sample_id=7)


def test_none_valued_keys_are_dropped(tok):
    """Arrow fills absent struct fields with None; they must not reach the template."""
    messages = [{**m, "name": None} for m in SINGLE]
    assert encode_chat(messages, tok) == encode_chat(SINGLE, tok)


# ---- loading ---------------------------------------------------------------------------------------


def _rows():
    return [{"messages": m, "source": f"s{i}"} for i, m in enumerate(CHATS)]


def test_load_jsonl_json_parquet_and_rows_agree(tmp_path):
    rows = _rows()
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    js = tmp_path / "d.json"
    js.write_text(json.dumps(rows))
    pq = tmp_path / "d.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(pq))
    cache = tmp_path / "hf"
    loaded = [load_chat_data(p, cache_dir=cache) for p in (jsonl, js, pq)] + [load_chat_data(rows)]
    for ds in loaded:
        assert isinstance(ds, datasets.Dataset) and len(ds) == 3
        for row, orig in zip(ds, rows):
            assert [(m["role"], m["content"]) for m in row["messages"]] == [
                (m["role"], m["content"]) for m in orig["messages"]
            ]
    assert loaded[0].cache_files  # file-backed: Arrow cache on disk
    # several files keep file order
    both = load_chat_data([jsonl, str(jsonl)], cache_dir=cache)
    assert len(both) == 6 and both[3]["source"] == "s0"
    assert load_chat_data(loaded[3]) is loaded[3]


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_chat_data(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a\n1\n")
    with pytest.raises(ValueError, match="unknown chat data type"):
        load_chat_data(tmp_path / "d.csv")
    (tmp_path / "a.jsonl").write_text(json.dumps(_rows()[0]) + "\n")
    datasets.Dataset.from_list(_rows()).to_parquet(str(tmp_path / "b.parquet"))
    with pytest.raises(ValueError, match="mix JSON and parquet") as info:
        load_chat_data([tmp_path / "a.jsonl", tmp_path / "b.parquet"])
    convert = re.search(r'python -c "(.*)"\)$', str(info.value)).group(1)  # the conversion the error gives
    exec(convert.replace("a.parquet", str(tmp_path / "b.parquet")).replace("a.jsonl", str(tmp_path / "b.jsonl")))
    assert len(load_chat_data([tmp_path / "a.jsonl", tmp_path / "b.jsonl"])) == 1 + len(_rows())
    with pytest.raises(ValueError, match="no paths or rows"):
        load_chat_data([])
    with pytest.raises(TypeError, match="int"):
        load_chat_data(3)
    with pytest.raises(ValueError, match=r"sample 1: language-modeling row \(field 'text'\)"):
        load_chat_data([_rows()[0], {"text": "x"}])
    with pytest.raises(ValueError, match=r"sample 1: row has none of the fields of a supported chat format"):
        load_chat_data([_rows()[0], {"question": "x"}])
    bad = [_rows()[0], {"messages": [{"role": "user", "content": 3}]}]
    with pytest.raises(TypeError, match=r"sample 1: messages\[0\]\.content must be a str"):
        load_chat_data(bad)


# ---- encode_dataset --------------------------------------------------------------------------------


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_encode_dataset_columns_and_rows(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows() * 2)
    ds = encode_dataset(load_chat_data(path, cache_dir=tmp_path / "hf"), tok)
    assert sorted(ds.column_names) == ["input_ids", "labels", "length", "sample_id"]
    assert ds["sample_id"] == list(range(6))
    for i, row in enumerate(ds):
        assert {k: row[k] for k in ("input_ids", "labels", "length")} == encode_chat(CHATS[i % 3], tok)
    assert ds.features["input_ids"].feature.dtype == "int32"


def _counting(monkeypatch):
    calls = []
    real = chat_mod._encode_many

    def counted(batch, tokenizer, ids):
        calls.append(list(ids))
        return real(batch, tokenizer, ids)

    monkeypatch.setattr(chat_mod, "_encode_many", counted)
    return calls


def test_encode_dataset_is_cached_for_files(tmp_path, tok, monkeypatch):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows())
    calls = _counting(monkeypatch)
    first = encode_dataset(load_chat_data(path, cache_dir=tmp_path / "hf"), tok)
    assert calls == [[0, 1, 2]]
    second = encode_dataset(load_chat_data(path, cache_dir=tmp_path / "hf"), tok)
    assert calls == [[0, 1, 2]]  # not encoded again
    assert second.cache_files == first.cache_files and second[:] == first[:]
    # another tokenizer (here: another template) is another cache entry
    with template(tok, tok.chat_template.replace("<|im_start|>assistant", "<|im_start|>assistant ")) as other:
        encode_dataset(load_chat_data(path, cache_dir=tmp_path / "hf"), other)
    assert len(calls) == 2


def test_encode_dataset_is_cached_for_rows(tmp_path, tok, monkeypatch):
    calls = _counting(monkeypatch)
    first = encode_dataset(_rows(), tok, cache_dir=tmp_path / "enc")
    second = encode_dataset(_rows(), tok, cache_dir=tmp_path / "enc")
    assert len(calls) == 1
    assert second.cache_files == first.cache_files and str(tmp_path / "enc") in first.cache_files[0]["filename"]


def test_encode_dataset_bad_row_names_it(tmp_path, tok):
    rows = _rows() + [{"messages": [{"role": "user", "content": "no answer"}], "source": "bad"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=r"sample 3: no assistant message"):
        encode_dataset(load_chat_data(path, cache_dir=tmp_path / "hf"), tok)
    with pytest.raises(ValueError, match=r"sample 0: language-modeling row \(field 'text'\)"):
        encode_dataset(datasets.Dataset.from_list([{"text": "x"}]), tok)


def test_encode_dataset_in_worker_processes(tmp_path, tok):
    """The map function pickles (num_proc > 1) and gives the same rows and sample ids."""
    rows = _rows() * 4
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    ds = load_chat_data(path, cache_dir=tmp_path / "hf")
    parallel = encode_dataset(ds, tok, num_proc=2, batch_size=2)
    assert parallel["sample_id"] == list(range(12))
    assert parallel[:] == encode_dataset(rows, tok, cache_dir=tmp_path / "enc")[:]


# ---- built-in data ---------------------------------------------------------------------------------


def test_topic_paragraphs_split():
    title, paragraphs = topic_paragraphs("The x\n*****\n\nIntro.\n\nPart\n====\n\nBody one.\n\n   code\n")
    assert title == "The x"
    assert paragraphs == [(None, "Intro."), ("Part", "Body one."), ("Part", "   code")]


def test_builtin_chats(tok, tmp_path):
    from pydoc_data.topics import topics

    chats = builtin_chats()
    assert chats == builtin_chats()  # deterministic
    assert 250 <= len(chats) <= 600
    assert {c["source"].split(":")[1] for c in chats} == set(topics)  # every topic used
    kinds = {c["source"].split(":")[2] for c in chats}
    assert kinds == {"overview", "detail", "two-turn", "long"}
    two_turn = [c for c in chats if sum(m["role"] == "assistant" for m in c["messages"]) == 2]
    assert len(two_turn) >= 30
    # answers are real reference text
    corpus = "\n".join(topics.values())
    for c in chats[::17]:
        for m in c["messages"]:
            if m["role"] == "assistant":
                assert m["content"].split("\n\n")[0] in corpus
    ds = encode_dataset(chats, tok, cache_dir=tmp_path / "enc")
    lengths = np.array(ds["length"])
    assert len(lengths) == len(chats)
    assert lengths.min() < 64 and lengths.max() > 1500 and lengths.max() < 4096  # spread; fits 4096
    assert np.percentile(lengths, 90) > 3 * np.percentile(lengths, 10)
    for row in ds:  # real text: labels equal the independent oracle on every conversation
        assert row["labels"] == expected_labels(tok, row["input_ids"]), row["sample_id"]


def test_empty_assistant_answer_is_refused_by_every_path(tmp_path, tok, capsys, monkeypatch):
    """``{"role": "assistant", "content": ""}`` was encoded and trained (its one supervised token the
    end-of-turn: the model learns to answer nothing), where an empty ShareGPT / Alpaca / TRL answer is refused:
    now refused the same way, naming the sample, the field and FILE:LINE (datasets path, streaming, CLI)."""
    from varpack.cli.main import main
    from varpack.data.stream import StreamingPackedDataset

    empty = [SINGLE[0], {"role": "assistant", "content": ""}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": SINGLE}) + "\n" + json.dumps({"messages": empty}) + "\n")
    want = r"sample 1: messages\[1\]\.content is empty \(an assistant answer with no text to supervise\)"
    with pytest.raises(ValueError, match=r"chats\.jsonl:2: " + want) as datasets_path:
        encode_dataset(load_chat_data(str(path)), tok)
    with pytest.raises(ValueError, match=want):
        load_chat_data([{"messages": SINGLE}, {"messages": empty}])
    with pytest.raises(ValueError, match=r"chats\.jsonl:2: " + want) as streamed:
        list(StreamingPackedDataset(str(path), tok, packing_length=256, buffer_size=4))
    # one form for every path: FILE:LINE: sample N: field, the file named as the caller wrote it
    assert str(streamed.value) == str(datasets_path.value) == f"{path}:2: " + str(datasets_path.value).split(":2: ")[1]
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "chats.jsonl"]) == 1
    assert re.search(r"^varpack plan: error: chats\.jsonl:2: " + want, capsys.readouterr().err.splitlines()[-1])
    with pytest.raises(ValueError, match=r"^chats\.jsonl:2: " + want):
        list(StreamingPackedDataset("chats.jsonl", tok, packing_length=256, buffer_size=4))
    # an assistant turn whose answer is a tool call (content "") is not empty
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    assert validate_messages([SINGLE[0], {"role": "assistant", "content": "", "tool_calls": [call]}])
